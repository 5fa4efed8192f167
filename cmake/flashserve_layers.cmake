# One static library per server/ folder, and a configure-time check that a folder includes only
# its own headers and those of the folders it is declared to depend on (server/README.md, "Layers").
# An include that runs upward or sideways stops the configure with the offending line named.
#
#   flashserve_server_layer(<folder> SOURCES <files...> LAYERS <lower folders...> LIBS <targets...>)
# makes target flashserve_<folder with / as _> from <folder>/<files>, linked to the lower layers'
# libraries and LIBS. Folders are relative to server/; the library exposes server/ and its gen/.

set(FLASHSERVE_SERVER_LAYERS "" CACHE INTERNAL "server/ folders declared so far, bottom first")

# Every folder of server/ that holds sources, relative to server/: an include of any of them is
# checked, whether that folder is declared yet or not.
function(flashserve_server_folders out)
  file(GLOB_RECURSE files RELATIVE ${PROJECT_SOURCE_DIR}/server
       ${PROJECT_SOURCE_DIR}/server/*.h ${PROJECT_SOURCE_DIR}/server/*.cc)
  set(folders "")
  foreach(file ${files})
    get_filename_component(dir ${file} DIRECTORY)
    if(dir)
      list(APPEND folders ${dir})
    endif()
  endforeach()
  list(REMOVE_DUPLICATES folders)
  set(${out} ${folders} PARENT_SCOPE)
endfunction()

function(flashserve_layer_target folder out)
  string(REPLACE "/" "_" name "${folder}")
  set(${out} flashserve_${name} PARENT_SCOPE)
endfunction()

# FATAL_ERROR when a file of `folder` includes a header of a declared server folder that is
# neither `folder` nor one of `allowed`.
function(flashserve_check_layer_includes folder allowed)
  file(GLOB files ${PROJECT_SOURCE_DIR}/server/${folder}/*.h ${PROJECT_SOURCE_DIR}/server/${folder}/*.cc)
  flashserve_server_folders(known)
  # Longest folder names first, so edge/grpc/x.h is read as edge/grpc, not as edge.
  list(SORT known ORDER DESCENDING)
  foreach(file ${files})
    file(STRINGS ${file} lines REGEX "^#include \"[a-z_/]+\\.h\"")
    foreach(line ${lines})
      string(REGEX REPLACE "^#include \"([a-z_/]+)\\.h\".*" "\\1" header "${line}")
      foreach(layer ${known})
        if(header MATCHES "^${layer}/[a-z_]+$")
          if(NOT layer STREQUAL folder AND NOT layer IN_LIST allowed)
            file(RELATIVE_PATH rel ${PROJECT_SOURCE_DIR} ${file})
            message(FATAL_ERROR "layering: ${rel} includes \"${header}.h\", but server/${folder} may "
                                "include only server/{${allowed}} (cmake/flashserve_layers.cmake, "
                                "server/README.md)")
          endif()
          break()
        endif()
      endforeach()
    endforeach()
  endforeach()
endfunction()

function(flashserve_server_layer folder)
  cmake_parse_arguments(ARG "" "" "SOURCES;LAYERS;LIBS" ${ARGN})
  foreach(lower ${ARG_LAYERS})
    if(NOT lower IN_LIST FLASHSERVE_SERVER_LAYERS)
      message(FATAL_ERROR "layering: server/${folder} depends on server/${lower}, which is not "
                          "declared below it")
    endif()
  endforeach()
  flashserve_check_layer_includes(${folder} "${ARG_LAYERS}")
  flashserve_layer_target(${folder} target)
  list(TRANSFORM ARG_SOURCES PREPEND ${PROJECT_SOURCE_DIR}/server/${folder}/)
  add_library(${target} STATIC ${ARG_SOURCES})
  target_include_directories(${target} PUBLIC ${PROJECT_SOURCE_DIR}/server ${PROJECT_BINARY_DIR}/server/gen)
  foreach(lower ${ARG_LAYERS})
    flashserve_layer_target(${lower} lower_target)
    target_link_libraries(${target} PUBLIC ${lower_target})
  endforeach()
  target_link_libraries(${target} PUBLIC ${ARG_LIBS})
  flashserve_set_warnings(${target})
  set(FLASHSERVE_SERVER_LAYERS ${FLASHSERVE_SERVER_LAYERS} ${folder} CACHE INTERNAL "")
endfunction()
